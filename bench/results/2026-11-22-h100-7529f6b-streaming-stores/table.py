import json,collections,sys
d=sys.argv[1]; variants=sys.argv[2].split(',')
R=collections.defaultdict(list)
def add(p,k,v,x): R[(p,k,v)].append(x)
for fn in ['fwd.txt','bwd.txt','wg.txt']:
  for l in open(d+'/'+fn):
    tag,v,js=l.split(' ',2)
    js=js.replace(':nan',':null').replace(':-nan',':null').replace(':inf',':null')
    try: j=json.loads(js)
    except: continue
    if tag=='fwd' and j.get('kind')=='tile':
      if j['ws']==1 and j['block_n']==256: add(j['preset'],'up_ws',v,j['up_ms']); add(j['preset'],'down_ws',v,j['down_ms'])
      if j['ws']==0 and j['pp']==0 and j['block_n']==256 and j['tma']==1 and j['group_m'][0]==16: add(j['preset'],'up_plain',v,j['up_ms']); add(j['preset'],'down_plain',v,j['down_ms'])
      if j['pp']==1 and j['mc']==0 and j['block_n']==256: add(j['preset'],'up_pp256',v,j['up_ms'])
    if tag=='fwd' and j.get('kind')=='fused': add(j['preset'],'combine',v,j['combine_ms'])
    if tag=='bwd' and 'da_ms' in j:
      add(j['preset'],'dA',v,j['da_ms']); add(j['preset'],'dX',v,j['dx_ms']); add(j['preset'],'dX_ws',v,j['dx_ws_ms'])
    if tag=='wg' and j.get('kind')=='wgrad' and j.get('impl')=='fused' and j['block_n']==256 and j['tma']==1:
      add(j['preset'],j['grad'],v,j['ms'])
keys=sorted(set((p,k) for p,k,v in R))
print('preset     kernel     '+' '.join('%-16s'%v for v in variants))
for p,k in keys:
  cells=[]
  b=R.get((p,k,variants[0]))
  for v in variants:
    x=R.get((p,k,v),[])
    s='/'.join('%.3f'%y for y in x)
    if b and x and v!=variants[0]: s+=' %+.0f%%'%(100*(min(x)/min(b)-1))
    cells.append('%-16s'%s)
  print('%-10s %-10s '%(p,k)+' '.join(cells))
